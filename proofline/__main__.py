from proofline.cli import main

main()
