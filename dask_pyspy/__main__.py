from dask_pyspy.cli import main

main()
