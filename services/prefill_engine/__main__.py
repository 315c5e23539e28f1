import sys

from services.prefill_engine.service import main

sys.exit(main())
