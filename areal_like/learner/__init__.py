"""The learner: layout, algorithms (pure functions), training step, checkpoints. Never imports engine."""
