"""One round of the store all-reduce: its driver (`allreduce`), its state, I/O, layout, errors,
lanes and checkpoints; the steps it runs are in `steps/`."""
