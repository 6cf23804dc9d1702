import sys

from llmc.cli import main

sys.exit(main())
