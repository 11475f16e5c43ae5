from launcher.cli import main

raise SystemExit(main())
