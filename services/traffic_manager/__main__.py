import sys

from services.traffic_manager.service import main

sys.exit(main())
