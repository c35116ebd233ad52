"""Scripts that run inside an env's own interpreter (where bwstack is not installed): standard library at
module level, the env's packages imported inside. They are files so that they can be read, linted and tested;
bwstack.probe.interp runs them."""
