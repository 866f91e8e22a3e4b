"""deltaboard's reference inference engine.

A deliberately small OpenAI-compatible server over transformers on CPU. It exists so
that the demo and the end-to-end tests run a real engine that loads the follower's
checkpoint directory, reloads it on request, and reports per-token logprobs computed
exactly as a direct forward pass of the same weights would compute them.
"""
