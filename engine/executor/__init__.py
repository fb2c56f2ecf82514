"""What runs the model: the model runner, tensor parallelism, the sampler, the loader, models, attention, layers."""
