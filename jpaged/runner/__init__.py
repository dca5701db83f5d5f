"""The device side: a plain schedule padded to a shape bucket and packed into one transfer, the one compiled step
(model, sampling), its warm-up and executable cache, the sampler and its inputs, and KV transfers (swap,
copy-on-write copies)."""
