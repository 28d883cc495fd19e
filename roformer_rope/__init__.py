"""roformer-rope tools: the `roformer-rope` command and the repo's folders under one namespace.

`roformer_rope.conversion`, `roformer_rope.tokenization` and `roformer_rope.scripts` map to the repo's
`conversion/`, `tokenization/` and `scripts/` folders (see setup.cfg). The model itself is the
`modeling_roformer_rope` package.
"""

__version__ = "0.1.0"
