"""The Ray side of kvserve, and the `kvserve` command line."""
