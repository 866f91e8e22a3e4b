"""deltaboard's reference inference engine.

A deliberately small OpenAI-compatible server over transformers on CPU. It exists so
that the demo and the end-to-end tests run a real engine that loads the follower's
checkpoint directory, reloads it on request, reports per-token logprobs computed
exactly as a direct forward pass of the same weights would compute them, and says with
every response what it holds (its version and a load counter), so that a sidecar can
tell its own loads from anyone else's.
"""
