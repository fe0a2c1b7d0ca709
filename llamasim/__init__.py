"""A simulated llama-server (b11312 shapes): the test, demo and benchmark stand-in for a real host.

Not part of the router: crossbar never imports it. `python -m llamasim --help` runs one.
"""

from llamasim.server import PromptCache, SimConfig, SimServer, chat_prompt, common_prefix

__all__ = ["PromptCache", "SimConfig", "SimServer", "chat_prompt", "common_prefix"]
