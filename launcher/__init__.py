"""`launcher`: the command line that plans, starts, supervises and stops an areal_like run."""
