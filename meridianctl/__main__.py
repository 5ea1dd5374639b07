from meridianctl.cli import main

main()
