"""What arrives from outside a run's code, and the limits put on it: environment variable names, the
variables a spec may set, the limits on spec values, the environment every replica starts with."""
