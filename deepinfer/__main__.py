"""`python -m deepinfer ...` is the `deepinfer` command."""
import sys

from deepinfer.cli.main import main

sys.exit(main())
