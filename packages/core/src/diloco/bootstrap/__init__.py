"""What runs inside every replica before the training function: the runner, the context it hands the
function, and how a replica's failure is read back."""
