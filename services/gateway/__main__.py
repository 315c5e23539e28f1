import sys

from services.gateway.service import main

sys.exit(main())
