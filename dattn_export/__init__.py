"""dattn-export: from D-Attn training output to verified, deployable artifacts."""

__version__ = "0.1.0"
