"""``python -m relaxspec``: the command line (as the ``relaxspec`` script), also what
``torchrun --nproc_per_node G -m relaxspec train-drafter ...`` starts in every process."""

import sys

from relaxspec.launch import main

if __name__ == "__main__":
    sys.exit(main())
