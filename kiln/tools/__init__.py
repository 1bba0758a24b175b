"""Tools around engines (Polygraphy-like): compare against a reference, find diverging layers."""
