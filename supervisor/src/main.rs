fn main() {
    std::process::exit(dflash_supervisor::main());
}
