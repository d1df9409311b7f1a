"""The policies an agent can run: ``simple`` (oracle, nop, scripted), ``openai`` (an
OpenAI-compatible endpoint), ``hf`` (a local transformers model); ``choose.make_policy``
builds one from its spec string (and a ``vllm:PATH`` policy from ``tmax.inference``)."""
