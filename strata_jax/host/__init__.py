"""The host tier: routed experts that do not fit the device's expert pool, computed on the host from their packed bytes
(`tier.HostTier`, one per MoE layer) on the model's worker pool (`pool.HostPool`)."""
