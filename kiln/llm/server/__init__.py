"""`kiln llm serve`: an OpenAI-compatible server over one model (app.py: the routes)."""

from kiln.llm.server.server import LLMServer, ServerOptions

__all__ = ["LLMServer", "ServerOptions"]
