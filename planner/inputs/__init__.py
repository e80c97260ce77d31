"""What a build is given: the spec (read, validated, its model's dimensions), the rules
and data files, and the build's options."""
