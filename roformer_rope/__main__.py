"""`python -m roformer_rope COMMAND ...`: the same as the `roformer-rope` console command."""

import sys

from roformer_rope.cli import main

if __name__ == "__main__":
    sys.exit(main())
