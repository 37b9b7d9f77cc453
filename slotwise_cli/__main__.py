"""python -m slotwise_cli: the `slotwise` command."""

import sys

from slotwise_cli import main

sys.exit(main())
