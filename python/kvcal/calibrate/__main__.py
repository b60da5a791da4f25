"""python -m kvcal.calibrate: the kvcal-calibrate command."""
import sys

from kvcal.calibrate.cli import main

sys.exit(main())
