"""The rollout sidecar: a version-aware proxy in front of an inference engine.

It embeds the follower (which keeps the checkpoint directory at an exact version),
swaps versions into the engine through an engine adapter, and proxies every request
to the engine once the version it is served with satisfies the request's
`weight_version` constraints.
"""
