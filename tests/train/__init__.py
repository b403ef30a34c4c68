"""Fine-tuning, the planner, the default model and the whole pipeline, on the CPU."""
