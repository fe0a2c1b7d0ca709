from llamasim.server import main

main()
