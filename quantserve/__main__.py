from quantserve.cli import main

main()
