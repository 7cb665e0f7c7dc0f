"""HTTP lives here and only here: headers <-> service calls, and one error table."""
