"""What the training loop touches: the `DiLoCo` API, the model's view as a flat vector, the copies
between model and host buffers, and when a round is due."""
