"""coding-stack proxy: the public OpenAI-compatible door on :11433."""
