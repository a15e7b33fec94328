import sys

from nemo_fp8_align.cli import main

sys.exit(main())
