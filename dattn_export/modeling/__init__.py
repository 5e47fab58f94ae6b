"""What ships to the Hub: the D-Attn configs, the model and its attention math. These files import only torch,
transformers and each other, so a published repo loads with `trust_remote_code=True` without this package."""
