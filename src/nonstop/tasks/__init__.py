"""Built-in tasks, the tiny-model factory and the supervised warm-up."""
