"""Learning side: pure losses, the Trainer (model, optimizer, step) and its actor worker."""
