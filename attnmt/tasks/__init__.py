"""Tasks: what loads the data and builds the model and criterion for a kind of problem."""
