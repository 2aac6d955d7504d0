"""The global model: θ_global and the outer optimizer's state, the outer step, the model's manifest
and configuration."""
