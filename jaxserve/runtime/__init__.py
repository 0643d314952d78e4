"""Runtime: what runs a step on the device: the runner, the input batch, sampling, buckets, the
builder, multi-host."""
