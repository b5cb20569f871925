from fedmvp.cli import main

main()
