"""The device side: a plain schedule padded to a shape bucket, the one compiled step (model, sampling, KV copies),
its warm-up and executable cache, the sampler and its inputs, and KV transfers (swap, copy-on-write)."""
