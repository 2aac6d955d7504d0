"""What a remote replica is sent: the workdir's files and the wheels of the diloco the launcher runs."""
