"""crossbar: an affinity router for a fleet of llama.cpp llama-server hosts, as a mitmproxy addon."""

__version__ = "0.1.0"
