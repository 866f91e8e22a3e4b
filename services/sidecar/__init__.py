"""The rollout sidecar: a version-aware proxy in front of an inference engine.

It embeds the follower (which keeps the checkpoint directory at an exact version),
swaps versions into the engine through an engine adapter, and proxies the engine's
inference routes (no others) once the version a request is served with satisfies its
`weight_version` constraints, stamping each response with that version only when the
engine reports it still holds what the sidecar loaded.
"""
