fn main() {
    std::process::exit(dflash_worker::main());
}
