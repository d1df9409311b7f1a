"""``python -m sandfleet.localslurm``: the local cluster helper (see the package doc)."""

import sys

from sandfleet.localslurm.commands import main

sys.exit(main())
