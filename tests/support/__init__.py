"""Shared test servers: a SearXNG-shaped server, a scripted OpenAI-shaped chat server,
helpers to run the proxy for real (gunicorn + gevent subprocess) and a real llama-server."""
