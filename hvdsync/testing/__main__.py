"""A rank's process: ``python -m hvdsync.testing <workdir>`` (or ``--horovodrun ...``)."""

import sys

from hvdsync.testing.harness import main

main(sys.argv[1:])
