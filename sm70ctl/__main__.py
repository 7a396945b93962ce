from sm70ctl.cli import main

main()
